import sys

from services.conductor.server import main

sys.exit(main())
