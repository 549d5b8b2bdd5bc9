"""What runs on files, not on requests.

Chains of writes judged in order (``chain``), policy test files (``policy_test_files``, run by ``policy_tests``,
reported by ``policy_test_report``), replays of kube-apiserver audit logs under a policy (``replay``,
``replay_input``, ``replay_results``) and queries and timelines of the guard's own audit log
(``audit_queries``, ``count_timeline``). Builds on ``admission`` (and the pure objects of ``kube``).
"""
