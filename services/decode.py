"""`pdserve decode` / `python -m services.decode`: a model worker in the decode role."""

import sys

from common import early_stop

early_stop.catch()  # before the heavy imports below: a stop while starting exits 0

from services.worker.server import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(role="decode"))
