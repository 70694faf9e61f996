import sys

from services.planner.server import main

sys.exit(main())
