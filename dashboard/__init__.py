"""The csinode-guard Grafana dashboard as code: the panels (:mod:`dashboard.panels`), the Grafana JSON built with
grafana-foundation-sdk (``python -m dashboard.build``) and a picture of the same queries rendered with matplotlib
from a Prometheus (``python -m dashboard.picture``). Not part of the served package: a tool of the repository."""
