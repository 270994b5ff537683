"""Files the operator image ships for the trainer pods' diagnostics sidecar (docs/diagnostics.md): `diagnose.py`,
the server, a standalone script (Python standard library only) that the sidecar runs in the trainer's image."""
