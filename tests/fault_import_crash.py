"""A backend module whose import segfaults when FAULT_IMPORT_CRASH=1, as a broken extension does.

The test imports it with the variable unset (so it can register ``run``), then sets it: the
sandbox child, which rebuilds the backend by importing this module, dies at import time.
"""

from __future__ import annotations

import os

import fault_backends

ENV = "FAULT_IMPORT_CRASH"

if os.environ.get(ENV) == "1":
    fault_backends.mark("import_crash")
    fault_backends._segfault()


def run(*args):
    return fault_backends.good(*args)
