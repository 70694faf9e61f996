"""`pdserve decode` / `python -m services.decode`: a model worker in the decode role."""

import sys

from services.worker.server import main

if __name__ == "__main__":
    sys.exit(main(role="decode"))
