"""Talking to a Kubernetes API.

The watch caches behind :class:`~webhook.admission.cluster.ClusterView` (``watch/``), the operator commands'
calls (``kubeapi``), the webhook configurations (``registration``), the ValidatingAdmissionPolicy rendering
(``vap``) and the cluster checks before an install (``preflight``, ``preflight_facts``, ``preflight_guard``;
``preflight_gather`` reads the cluster). The only layer that
imports the kubernetes client.
"""
