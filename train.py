"""Train a GPT-2 with fastgpt: `python train.py --help`; the same trainer as the console script fastgpt-train."""
import sys

from fastgpt.train import cli

sys.exit(cli())
