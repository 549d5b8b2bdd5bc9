"""The pure core: judging one CSINode write.

The AdmissionReview wire format (``review``), the CSINode shapes (``csinode``), the policy model and loading
(``policy``), the rules (``rules/``), evaluation (``evaluation``), the signed state annotation (``state``), the
JSON Patch (``patch``), justifications, versions, durations, the increase budget, the audit record, and the
:class:`~webhook.admission.cluster.ClusterView` protocol with its static implementation (``cluster``,
``facts``). Imports no Flask, kubernetes client, Prometheus or gunicorn, and nothing else from the package.
"""
