"""``python -m drafter.train``: train an EAGLE-3 head for a target (the CLI lives in tandem.training.cli)."""

import sys

from tandem.training.cli import main_train_drafter

if __name__ == "__main__":
    sys.exit(main_train_drafter())
