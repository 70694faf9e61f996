import sys

from services.cache_pool.server import main

sys.exit(main())
