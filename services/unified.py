"""`pdserve unified` / `python -m services.unified`: a model worker in the unified role."""

import sys

from services.worker.server import main

if __name__ == "__main__":
    sys.exit(main(role="unified"))
