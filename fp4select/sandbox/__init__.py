"""Probing in a child process: a candidate that crashes, hangs or breaks CUDA takes only the child.

One job a module, in the order a probe goes through them:

- ``prober``: ``SandboxProber``, what the selector calls; decides each candidate's verdict and
  whom to blame (its docstring holds the sandbox's rules).
- ``attempt``: one request to one worker, its events read and checked (the protocol's parent
  half) until it ends.
- ``process``: starting, reusing and ending the worker processes, and reading their lines.
- ``worker``: the child's own code (``process`` starts it with ``worker.main()``).
"""

from fp4select.sandbox.prober import PROTOCOL_STRIKES, SandboxProber, scaled_timeout_s
from fp4select.sandbox.worker import PROTOCOL_FD_ENV

__all__ = ["PROTOCOL_FD_ENV", "PROTOCOL_STRIKES", "SandboxProber", "scaled_timeout_s"]
