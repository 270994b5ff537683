"""The project's tooling: the embedded cluster, the offline image builder, Kueue, the kind node image, the demo."""
