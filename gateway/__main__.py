"""``python -m gateway``: not built yet — the services arrive with the services issue (issue 4)."""

import sys

if __name__ == "__main__":
    print("python -m gateway: the gateway service is not built yet (issue 4); use `tandem generate` for now", file=sys.stderr)
    sys.exit(2)
