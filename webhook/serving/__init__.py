"""The long-running server.

The Flask app (``app``), gunicorn's master and workers over TLS (``workers``), certificates (``tls``,
``dev_certs``, ``cert_rotation``) and the reloading SSLContext (``ssl_context``), metrics, the audit writer
(``audit_writer``), the live policy and its hot reload (``live_policy``), the worker runtime (``runtime``),
settings, logs and GC tuning. Builds on ``admission`` and ``kube``; never on
``simulation``.
"""
