"""csinode-guard: a policy-as-code admission webhook for mutable CSINode allocatable counts (KEP-4876)."""

__version__ = "0.1.0"
