"""``csinode-guard evaluate``: judge one AdmissionReview file offline and explain every rule's outcome."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO

import click
import yaml

from webhook.admission.cluster import ClusterView, UnknownClusterView
from webhook.admission.evaluation import Mode, evaluate, explain
from webhook.admission.facts import FactsError, view_from_facts
from webhook.admission.policy import PolicyError, load_policy
from webhook.admission.review import ReviewError, build_response, parse_review
from webhook.admission.safe_yaml import load_yaml
from webhook.admission.state import StateKeys, parse_time


class InputError(click.ClickException):
    """Unusable input (review, policy, facts, key): exit code 2, distinct from a denial (1)."""

    exit_code = 2


def _keys(path: Path | None) -> tuple[StateKeys, str]:
    from webhook.admission.state_key import StateKeyError, ensure_state_key  # noqa: PLC0415

    if path is None:
        default = Path("certs/state.key")
        if not default.exists():
            import os  # noqa: PLC0415

            return StateKeys([os.urandom(32)]), "a throwaway key (state on the object will not verify)"
        path = default
    if not path.exists():
        raise InputError(f"--state-key-file: {path} does not exist")
    try:
        return StateKeys(ensure_state_key(path)), str(path)
    except (StateKeyError, ValueError) as exc:
        raise InputError(f"--state-key-file: {exc}") from None


@click.command("evaluate")
@click.option("--review", "review_file", required=True, type=click.File("rb"),
              help="AdmissionReview JSON file, or - for standard input.")
@click.option("--policy", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Policy YAML (default: the bundled policy).")
@click.option("--now", "now_text", help="Evaluation time, RFC 3339 (default: now, UTC).")
@click.option("--endpoint", type=click.Choice(["mutate", "validate"]), default="mutate", show_default=True)
@click.option("--state-key-file", type=click.Path(dir_okay=False, path_type=Path),
              help="State HMAC key file (default: certs/state.key when present).")
@click.option("--cluster-facts", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="YAML with node labels, driver versions, periods, attach errors (see webhook/admission/facts.py).")
def evaluate_command(review_file: BinaryIO, policy: Path | None, now_text: str | None, endpoint: str,
                     state_key_file: Path | None, cluster_facts: Path | None) -> None:
    """Print the AdmissionReview response for REVIEW, and one line per rule explaining its outcome.

    Standard output carries only the response (JSON, so 'evaluate ... | jq' works); the explanation lines
    ('# decision: ...', one per rule, the patch) go to standard error.
    Exit code 0 when the write is allowed, 1 when denied, 2 for unusable input (review, policy, facts, key).
    --now without a UTC offset is taken as UTC.
    """
    name = getattr(review_file, "name", "-")
    try:
        request = parse_review(review_file.read())
    except ReviewError as exc:
        raise InputError(f"{name}: {exc.message}") from None
    try:
        loaded = load_policy(policy)
    except PolicyError as exc:
        raise InputError(str(exc)) from None
    try:
        now = parse_time(now_text) if now_text else datetime.now(UTC)
    except ValueError:
        raise InputError(f"--now: not an RFC 3339 time: {now_text}") from None
    cluster: ClusterView = UnknownClusterView()
    if cluster_facts is not None:
        try:
            cluster = view_from_facts(load_yaml(cluster_facts.read_text("utf-8")))
        except UnicodeDecodeError as exc:
            raise InputError(f"{cluster_facts}: not UTF-8 text (byte {exc.start}); cluster facts are YAML or JSON"
                             ) from None
        except OSError as exc:
            raise InputError(f"{cluster_facts}: cannot read: {exc.strerror or exc}") from None
        except (FactsError, yaml.YAMLError) as exc:
            raise InputError(f"{cluster_facts}: {exc}") from None
    keys, key_source = _keys(state_key_file)
    mode = Mode(endpoint)
    decision = evaluate(request, loaded, cluster, now, keys, mode=mode)
    document = build_response(request.uid, decision.response, allow_patch=mode is Mode.MUTATE)
    click.echo(json.dumps(document, indent=2))
    click.echo(f"# decision: {decision.decision.value} (policy {loaded.source}, hash {loaded.hash}, "
               f"at {now.isoformat()}, state key: {key_source})", err=True)
    for line in explain(decision):
        click.echo(f"# {line}", err=True)
    if decision.response.patch:
        click.echo("# patch: " + json.dumps(list(decision.response.patch)), err=True)
    sys.exit(0 if decision.response.allowed else 1)
