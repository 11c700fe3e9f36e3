"""``python -m fp4select.sandbox`` starts a sandbox worker by hand (as the prober does)."""

from fp4select.sandbox.worker import main

main()
