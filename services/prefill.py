"""`pdserve prefill` / `python -m services.prefill`: a model worker in the prefill role."""

import sys

from services.worker.server import main

if __name__ == "__main__":
    sys.exit(main(role="prefill"))
