"""The dashboard's rows and panels, one row per rollout signal, as plain data.

Every query selects ``namespace=~"$namespace"`` (the dashboard's installation variable); Grafana substitutes it,
and :func:`expand` does the same for the tests and the picture. Units are Grafana unit ids.
"""

from __future__ import annotations

from dataclasses import dataclass

NAMESPACE = '$namespace'
SEL = f'namespace=~"{NAMESPACE}"'


@dataclass(frozen=True)
class Query:
    """One PromQL target: ``expr`` and the legend Grafana draws for each series (``{{label}}`` templates)."""

    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    """A time series panel: ``title``, what it shows (``description``, shown in Grafana's panel info), ``unit``,
    its ``queries`` and, optionally, the value from which it is red (``red``, drawn as a threshold)."""

    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    red: float | None = None


@dataclass(frozen=True)
class Row:
    """A dashboard row: one signal of the rollout."""

    title: str
    panels: tuple[Panel, ...]


def q(expr: str, legend: str) -> Query:
    """A :class:`Query`."""
    return Query(expr, legend)


ROWS: tuple[Row, ...] = (
    Row("Count changes and decisions", (
        Panel("Decisions by endpoint", "AdmissionReviews answered per second by endpoint and decision "
              "(allow, clamp, deny, warn, dryrun), without the apiserver's dry runs.", "reqps", (
                  q(f'sum by (endpoint, decision) (csinode_guard:requests:rate5m{{{SEL}, dry_run="false"}})',
                    "{{endpoint}} {{decision}}"),)),
        Panel("Violations by rule and driver", "Rule violations per second by rule, driver and the enforcement "
              "action that applied (dryrun and warn: would-be denials while rolling out).", "reqps", (
                  q(f'sum by (rule, driver, enforcement) (csinode_guard:violations:rate5m{{{SEL}}})',
                    "{{rule}} {{driver}} {{enforcement}}"),)),
    )),
    Row("Write rate to the apiserver", (
        Panel("CSINode writes judged, with and without clamps", "Writes reaching the mutating webhook per second: "
              "clamped ones (the count rewritten; a clamp back to the stored count is a no-op write) and the "
              "rest.", "reqps", (
                  q(f'sum(csinode_guard:requests:rate5m{{{SEL}, endpoint="mutate", decision="clamp"}})', "clamped"),
                  q(f'sum(csinode_guard:requests:rate5m{{{SEL}, endpoint="mutate", decision!="clamp"}})',
                    "not clamped"),)),
        Panel("Writes repeated by persistent disagreement", "Writes refused or clamped back to the stored count, by "
              "driver and rule: kubelet resends them every period until the driver or the policy is fixed.",
              "reqps", (
                  q(f'sum by (driver, rule) (rate(csinode_guard_persistent_disagreement_total{{{SEL}}}[5m]))',
                    "{{driver}} {{rule}}"),)),
    )),
    Row("Attach errors", (
        Panel("VolumeAttachments with attach errors, by class", "VolumeAttachments carrying status.attachError, by "
              "driver and class: capacity (ResourceExhausted, KEP-4876: the count was too high), permission, "
              "precondition (topology, zone), transient (network, timeouts), other.", "short", (
                  q(f'max by (driver, class) (csinode_guard_attach_errors{{{SEL}}})', "{{driver}} {{class}}"),),
              red=1),
    )),
    Row("Standing violations (background audit)", (
        Panel("Standing violations", "Stored counts the policy in force refuses, by rule and driver (the audit's "
              "last pass).", "short", (
                  q(f'max by (rule, driver) (csinode_guard_standing_violations{{{SEL}}})', "{{rule}} {{driver}}"),),
              red=1),
        Panel("Audit passes and repairs", "Audit passes per hour by trigger, and counts lowered by the reconciler by "
              "driver and result.", "short", (
                  q(f'sum by (trigger) (increase(csinode_guard_audit_passes_total{{{SEL}}}[1h]))', "pass {{trigger}}"),
                  q(f'sum by (driver, result) (increase(csinode_guard_reconcile_repairs_total{{{SEL}}}[1h]))',
                    "repair {{driver}} {{result}}"),)),
        Panel("Seconds since the last audit pass", "Age of the newest audit pass, and which replica leads the "
              "audit (1).", "s", (
                  q(f'time() - max(csinode_guard_audit_last_pass_timestamp_seconds{{{SEL}}})', "last pass age"),
                  q(f'max by (pod) (csinode_guard_leader{{{SEL}}})', "leader {{pod}}"),)),
    )),
    Row("Freezes and rollbacks", (
        Panel("Freezes after driver version rollbacks", "Entries whose increases were frozen in the last hour, by "
              "driver.", "short", (
                  q(f'sum by (driver) (increase(csinode_guard_freezes_total{{{SEL}}}[1h]))', "{{driver}}"),), red=1),
        Panel("Rollback and version violations", "Violations of count-rollback (increases undoing a correction, "
              "frozen entries) and writer-version (old or rolled-back drivers) per second, by driver.", "reqps", (
                  q(f'sum by (rule, driver) (csinode_guard:violations:rate5m{{{SEL}, '
                    f'rule=~"count-rollback|writer-version"}})', "{{rule}} {{driver}}"),)),
        Panel("Brakes engaged by driver", "1 while the automatic brake of a driver is engaged: capacity-class "
              "attach failures followed the increases the guard admitted, every increase of the driver is held "
              "cluster-wide (docs/brake.md). One line at 0 while no brake was ever engaged.", "short", (
                  q(f'max by (driver) (csinode_guard_brake_engaged{{{SEL}}}) or on() vector(0)', "{{driver}}"),),
              red=1),
    )),
    Row("Headroom", (
        Panel("Attach headroom per driver", "Mean allocatable count minus attached volumes of the nodes whose writes "
              "were judged, per driver (volumes).", "short", (
                  q(f'max by (driver) (csinode_guard:attach_headroom_volumes:avg5m{{{SEL}}})', "{{driver}}"),)),
        Panel("Writes judged with no attach slot left", "Share of judged writes whose node had no headroom left "
              "(attached >= allocatable) for the driver.", "percentunit", (
                  q(f'max by (driver) (csinode_guard:attach_headroom_exhausted:ratio5m{{{SEL}}})', "{{driver}}"),),
              red=0.5),
    )),
    Row("Admission latency", (
        Panel("Answer time against timeoutSeconds", "99th percentile of the time to answer an AdmissionReview, by "
              "endpoint; the webhooks' timeoutSeconds is 5 s (red from half of it).", "s", (
                  q(f'max by (endpoint) (csinode_guard:request_duration_seconds:p99_5m{{{SEL}}})',
                    "p99 {{endpoint}}"),),
              red=2.5),
        Panel("Late answers: after the apiserver's deadline", "AdmissionReviews answered after the apiserver "
              "stopped waiting (past the timeout it sent, or on a connection it had closed) in the last 5 minutes, "
              "by endpoint: the apiserver applied the webhook's failurePolicy, the guard's decision did not take "
              "effect (their audit records say \"late\": true).", "short", (
                  q(f'sum by (endpoint) (increase(csinode_guard_late_answers_total{{{SEL}}}[5m]))', "{{endpoint}}"),),
              red=1),
    )),
    Row("Cluster caches", (
        Panel("Cache staleness", "Seconds since each watch was lost (0 while up); above --max-staleness (120 s) its "
              "facts count as unknown.", "s", (
                  q(f'max by (kind) (csinode_guard_cache_staleness_seconds{{{SEL}}})', "{{kind}}"),), red=120),
        Panel("Caches synced", "1 when every replica's cache of the kind has completed its list.", "short", (
                  q(f'min by (kind) (csinode_guard_cache_synced{{{SEL}}})', "{{kind}}"),)),
    )),
    Row("Serving certificate", (
        Panel("Serving certificate expiry", "Days until the serving certificate expires, per replica (red within "
              "2 days).", "d", (
                  q(f'min by (pod) (csinode_guard_serving_certificate_expiry_timestamp_seconds{{{SEL}}} - time()) '
                    '/ 86400', "{{pod}}"),), red=2),
    )),
    Row("Policy in force", (
        Panel("Policy generation by name and hash", "The generation of the policy each replica serves, labelled "
              "by policy name and hash (replicas should agree).", "short", (
                  q(f'max by (pod, name, hash) (csinode_guard_policy_info{{{SEL}}}) * on (pod) group_left '
                    f'max by (pod) (csinode_guard_policy_generation{{{SEL}}})', "{{pod}} {{name}} {{hash}}"),)),
        Panel("Policy file refused", "1 while a replica's policy file does not validate (it serves the last good "
              "policy).", "short", (
                  q(f'max by (pod) (csinode_guard_policy_file_invalid{{{SEL}}})', "{{pod}}"),), red=1),
    )),
)
"""The dashboard, top to bottom."""

def expand(expr: str, namespace: str) -> str:
    """``expr`` with the dashboard variable substituted as Grafana would (``$namespace`` -> ``namespace``)."""
    return expr.replace(NAMESPACE, namespace)
