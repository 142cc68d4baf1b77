"""The run-state record kept beside a run's checkpoints: its identity across attempts.

``{storage}/{name}/raytrain-run.json`` holds the MLflow run id, the spec's digest and flat
form, and the number of attempts. A rerun reads it to continue the same MLflow run, and to
refuse to resume a run whose spec changed in a way that makes it another experiment.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from raytrain import storage
from raytrain.checkpoints.layout import run_dir
from raytrain.errors import RunStateError
from raytrain.spec import RESUMABLE_FIELDS, JobSpec
from raytrain.util.redaction import masked_fields, redact, redact_flat

STATE_FILE = "raytrain-run.json"


@dataclass
class RunState:
    name: str
    spec_digest: str
    spec: dict[str, Any]
    mlflow_run_id: str | None = None
    tracking_uri: str | None = None
    attempts: int = 0
    restarts: int = 0  # worker-group restarts within attempts, all attempts together
    created_at: float = field(default_factory=time.time)
    status: str = "CREATED"


def load(spec: JobSpec) -> RunState | None:
    """The recorded state of the run ``spec`` names, or None for a new run. A state file
    that cannot be read as one (truncated, not JSON, a key or type this version does not
    know) is a ``RunStateError`` naming it; ``--fresh`` starts such a run over."""
    path = storage.join(run_dir(spec), STATE_FILE)
    try:
        text = storage.read_text(path, spec.storage)
        if text is None:
            return None
        return _from_record(json.loads(text))
    except (ValueError, TypeError, RecursionError) as exc:  # JSONDecodeError, UnicodeError
        why = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise RunStateError(
            f"{path}: the run's state file cannot be read ({why}); pass --fresh to start "
            "the run over, or restore the file"
        ) from None


# What each field of the state file may hold: (types, required).
_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "name": ((str,), True),
    "spec_digest": ((str,), True),
    "spec": ((dict,), True),
    "mlflow_run_id": ((str, type(None)), False),
    "tracking_uri": ((str, type(None)), False),
    "attempts": ((int,), False),
    "restarts": ((int,), False),
    "created_at": ((int, float), False),
    "status": ((str,), False),
}


def _from_record(record: object) -> RunState:
    """A ``RunState`` from the state file's JSON, every key and type checked."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    unknown = sorted(set(record) - set(_FIELDS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown[:5]))[:120]}")
    for key, (types, required) in _FIELDS.items():
        if key not in record:
            if required:
                raise ValueError(f"the key {key!r} is missing")
            continue
        value = record[key]
        if isinstance(value, bool) or not isinstance(value, types):
            raise ValueError(f"{key!r} holds {type(value).__name__}")
    return RunState(**record)


def save(spec: JobSpec, state: RunState) -> None:
    """Write ``state`` with its spec and tracking URI redacted: the file never holds a
    credential (a change to one still shows in ``spec_digest``)."""
    record = asdict(state)
    record["spec"] = redact_flat(state.spec)
    record["tracking_uri"] = redact(state.tracking_uri) if state.tracking_uri else None
    text = json.dumps(record, indent=2)
    storage.write_text(storage.join(run_dir(spec), STATE_FILE), text, spec.storage)


def changed_fields(state: RunState, spec: JobSpec) -> list[str]:
    """Fields that differ from the recorded spec and make this another experiment. Both
    sides are compared redacted (the file holds the redacted spec; one written before it
    did may not): a changed credential is not listed, only seen in the digest."""
    then, now = redact_flat(state.spec), redact_flat(spec.flat())
    keys = set(now) | set(then)
    return sorted(
        k for k in keys if not k.startswith(RESUMABLE_FIELDS) and then.get(k) != now.get(k)
    )


def check_resumable(state: RunState, spec: JobSpec) -> None:
    """Raise when the run was started with a spec this one may not resume. The message
    shows the old and new values of changed fields, credentials masked."""
    if state.spec_digest == spec.digest():
        return
    changed = changed_fields(state, spec)
    then, now = redact_flat(state.spec), redact_flat(spec.flat())
    details = "; ".join(f"{k}: {then.get(k)!r} -> {now.get(k)!r}" for k in changed)
    if not changed:
        masked = [k for k in masked_fields(spec.flat()) if not k.startswith(RESUMABLE_FIELDS)]
        details = "a credential-like value changed, which is never shown or recorded"
        details += f"; masked fields: {', '.join(masked)}" if masked else ""
    raise RunStateError(
        f"name: run {spec.name!r} in {run_dir(spec)} was started with a different spec "
        f"({details}); pass --fresh to start it over, --resume-anyway to continue it, "
        "or choose another name"
    )


def new_state(spec: JobSpec) -> RunState:
    return RunState(name=spec.name, spec_digest=spec.digest(), spec=spec.flat())
