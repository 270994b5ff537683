"""The project's tooling: the embedded cluster, the offline image builder, Kueue, the kind node image, the demo.

One import rule, so that each module is loaded once per process: modules import one another as this package
(`from hack import common`, `from hack.common import CACHE`), never by bare name or by path; a script run as
`python hack/x.py` first puts the repository root on sys.path (`if not __package__:`). No module runs as a
subprocess a script that imports it back. tests/unit/test_hack_imports.py checks all three.
"""
