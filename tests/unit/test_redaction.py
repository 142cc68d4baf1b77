"""One redaction for what raytrain writes and prints: the pattern table, then each place a
spec's credentials could land (MLflow params, tags and the spec.yaml artifact, the
run-state file, a TrackingError, a refused resume), checked on the real thing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytrain.driver.run_record import RunRecord
from raytrain.errors import RunStateError, TrackingError
from raytrain.records import runstate
from raytrain.spec import load_spec, parse_spec
from raytrain.tracking.mlflow_tracker import redacted_params
from raytrain.util.redaction import REDACTED, is_secret_name, redact, redact_flat
from tests.conftest import digits_spec

SECRET_NAMES = [
    "password",
    "passwd",
    "secret",
    "secret_key",
    "private_key",
    "hf_token",
    "auth_token",
    "access_token",
    "token",
    "api_key",
    "apiKey",
    "access_key",
    "credentials",
    "connection_string",
    "sas",
    "model.init_args.hf_token",
    "MLFLOW_TRACKING_PASSWORD",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_ACCESS_KEY_ID",
    "AWS_SESSION_TOKEN",
    "HF_TOKEN",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_CONNECTION_STRING",
    "DATABASE_URL",
    "GCP_PRIVATE_KEY",
    "GOOGLE_SERVICE_ACCOUNT_JSON",
    "MY_SERVICE_ACCOUNT",
    # run together in one word
    "accesstoken",
    "privatekey",
    "secretkey",
    "authtoken",
    "clientsecret",
    "hftoken",
    "model.init_args.apitoken",
]
# Names near those that hold no credential: a tokenizer's tokens, counts, plain keys.
PLAIN_NAMES = [
    "max_tokens",
    "num_tokens",
    "pad_token",
    "eos_token",
    "token_dim",
    "key",
    "primary_key",
    "lr",
    "monitor",
    "MLFLOW_TRACKING_URI",
    "LOG_LEVEL",
    "RAY_AUTH_TOKEN_PATH",
    "keep",
]


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_names_that_hold_a_credential(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize("name", PLAIN_NAMES)
def test_names_that_do_not(name: str) -> None:
    assert not is_secret_name(name)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # user info ends at the LAST @ before the host
        ("https://user:p@ss@host", f"https://{REDACTED}@host"),
        ("https://user:pa/ss@host/x", f"https://{REDACTED}@host/x"),
        ("see http://u:p@h:5000 and http://h2", f"see http://{REDACTED}@h:5000 and http://h2"),
        ("https://TOKEN123@github.com/o/r", f"https://{REDACTED}@github.com/o/r"),
        # not user info: a port and an @ in the query; Azure's container@account
        ("http://host:8080/p?e=a@b", "http://host:8080/p?e=a@b"),
        ("abfs://box@acct.dfs.core.windows.net/x", "abfs://box@acct.dfs.core.windows.net/x"),
        # query parameters that carry a credential
        (
            "https://a.blob.core.windows.net/c/f?sv=2022-11-02&se=2030&sig=abc%2Bd&sp=r",
            f"https://a.blob.core.windows.net/c/f?sv=2022-11-02&se=2030&sig={REDACTED}&sp=r",
        ),
        (
            "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4&X-Amz-Credential=AKID%2F2025"
            "&X-Amz-Security-Token=FQoG&X-Amz-Signature=beef&X-Amz-Expires=60",
            f"https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4&X-Amz-Credential={REDACTED}"
            f"&X-Amz-Security-Token={REDACTED}&X-Amz-Signature={REDACTED}&X-Amz-Expires=60",
        ),
        ("postgresql://h/db?user=u&password=pw", f"postgresql://h/db?user=u&password={REDACTED}"),
        ("http://h/?token=abc&page=2", f"http://h/?token={REDACTED}&page=2"),
        ("http://h/?access_token=abc", f"http://h/?access_token={REDACTED}"),
        ("https://h/x?key=AIzaSy", f"https://h/x?key={REDACTED}"),
        ("sort key=name", "sort key=name"),  # a plain "key" outside a URL query
        # connection strings and assignments in a message
        (
            "DefaultEndpointsProtocol=https;AccountName=a;AccountKey=ab+/==;EndpointSuffix=x",
            f"DefaultEndpointsProtocol=https;AccountName=a;AccountKey={REDACTED};EndpointSuffix=x",
        ),
        (
            "override 'model.init_args.password=hunter2': bad",
            f"override 'model.init_args.password={REDACTED}': bad",
        ),
        # values shaped like a credential, whatever holds them
        ("key AKIAABCDEFGHIJKLMNOP here", f"key {REDACTED} here"),
        ("hf_" + "a1B2" * 9, REDACTED),
        ("ghp_" + "x" * 36, REDACTED),
        ("-----BEGIN RSA PRIVATE KEY-----\nMIIE\n-----END RSA PRIVATE KEY-----", REDACTED),
        ("Authorization: Bearer abc.def", f"Authorization: Bearer {REDACTED}"),
        ("sk-learn-baseline-experiment-01", "sk-learn-baseline-experiment-01"),  # a name
        # query names short for a password; other Authorization schemes, lower case
        ("mysql://h/db?user=u&pass=pw1", f"mysql://h/db?user=u&pass={REDACTED}"),
        ("https://h/?pw=pw1", f"https://h/?pw={REDACTED}"),
        ("Authorization: Basic dXNlcjpwdzE=", f"Authorization: Basic {REDACTED}"),
        ("authorization: bearer abc.def", f"authorization: bearer {REDACTED}"),
        ("headers {'X-Api-Key': 'k1'}", f"headers {{'X-Api-Key': '{REDACTED}'}}"),
        # a dict's repr or JSON in a message: the key names the credential
        ("got {'password': 'pw1', 'lr': 0.1}", f"got {{'password': '{REDACTED}', 'lr': 0.1}}"),
        ('{"hf_token": "t1", "n": 2}', f'{{"hf_token": "{REDACTED}", "n": 2}}'),
        ("{'secret_key': 12345}", f"{{'secret_key': {REDACTED}}}"),
        # user info without a scheme, as an SDK quotes a bucket name back
        ("for bucket 'u:pw1@bucket': failed", f"for bucket '{REDACTED}@bucket': failed"),
        ("field: error: 3", "field: error: 3"),  # a field's error is not user info
    ],
)
def test_credentials_inside_text_are_masked(text: str, expected: str) -> None:
    assert redact(text) == expected
    assert redact(expected) == expected  # masking twice changes nothing


def test_a_secret_field_keeps_its_name_and_loses_its_value() -> None:
    flat = {
        "model.init_args.password": 1234,
        "model.init_args.lr": 0.1,
        "x.hf_token": None,
        "model.init_args.urls": ["http://u:p@h/", "http://h2/"],
    }
    assert redact_flat(flat) == {
        "model.init_args.password": REDACTED,
        "model.init_args.lr": 0.1,
        "x.hf_token": None,  # nothing to hide
        "model.init_args.urls": [f"http://{REDACTED}@h/", "http://h2/"],
    }


# Each secret below must appear nowhere raytrain writes.
HF = "hf_" + "Q" * 34
SECRETS = [
    "hunter2",
    HF,
    "SKEY-123",
    "PRIVKEY-456",
    "SASSIG789",
    "AMZTOKEN",
    "AMZSIG",
    "QUERYPW",
    "USERPW",
    "ss@",
]


def _secret_spec(tmp_path: Path, digits_dir: Path) -> dict:
    spec = digits_spec(digits_dir, tmp_path)
    spec["model"]["init_args"].update(
        password="hunter2",
        hf_token=HF,
        secret_key="SKEY-123",
        private_key="PRIVKEY-456",
        blob_url="https://a.blob.core.windows.net/c/x?sv=2022&sig=SASSIG789",
        presigned="https://b.s3.amazonaws.com/k?X-Amz-Security-Token=AMZTOKEN&X-Amz-Signature=AMZSIG",
        db="postgresql://db/x?password=QUERYPW",
        mirror="https://alice:USERPW@p@ss@hub.example.com/models",
    )
    spec["tracking"]["mlflow"]["tags"] = {"team": "vision", "hub_token": HF}
    return spec


def _no_secret(text: str) -> None:
    leaked = [secret for secret in SECRETS if secret in text]
    assert not leaked, f"leaked {leaked} in:\n{text}"


def test_params_mask_credential_keys_and_query_strings(tmp_path: Path, digits_dir: Path) -> None:
    params = redacted_params(parse_spec(_secret_spec(tmp_path, digits_dir)).flat())
    _no_secret(json.dumps(params))
    for field in ("password", "hf_token", "secret_key", "private_key"):
        assert params[f"model.init_args.{field}"] == REDACTED  # named, value masked
    assert params["model.init_args.blob_url"].endswith(f"sig={REDACTED}")
    assert params["model.init_args.mirror"] == f"https://{REDACTED}@hub.example.com/models"
    assert params["model.init_args.lr"] == "0.003"


def test_the_run_state_file_holds_no_credential(tmp_path: Path, digits_dir: Path) -> None:
    spec = parse_spec(_secret_spec(tmp_path, digits_dir))
    state = runstate.new_state(spec)
    state.tracking_uri = "https://alice:USERPW@mlflow.example.com/"
    runstate.save(spec, state)
    text = (Path(runstate.run_dir(spec)) / runstate.STATE_FILE).read_text()
    _no_secret(text)
    record = json.loads(text)
    assert record["spec"]["model.init_args.hf_token"] == REDACTED
    assert record["tracking_uri"] == f"https://{REDACTED}@mlflow.example.com/"
    loaded = runstate.load(spec)
    assert loaded is not None
    runstate.check_resumable(loaded, spec)  # the same spec still resumes


def test_mlflow_params_tags_and_spec_yaml_hold_no_credential(
    tmp_path: Path, digits_dir: Path
) -> None:
    from mlflow.tracking import MlflowClient

    job = parse_spec(_secret_spec(tmp_path, digits_dir))
    record = RunRecord(job, None)
    record.start()
    tracker = record.tracker()
    client = MlflowClient(tracking_uri=job.tracking.mlflow.tracking_uri)
    run = client.get_run(tracker.run_id)
    _no_secret(json.dumps(run.data.params))
    _no_secret(json.dumps(run.data.tags))
    assert run.data.params["model.init_args.hf_token"] == REDACTED
    assert run.data.tags["hub_token"] == REDACTED
    spec_yaml = Path(client.download_artifacts(tracker.run_id, "spec.yaml", str(tmp_path)))
    text = spec_yaml.read_text()
    _no_secret(text)
    assert f"hf_token: '{REDACTED}'" in text
    _no_secret((Path(runstate.run_dir(job)) / runstate.STATE_FILE).read_text())
    record.finish("FINISHED")


def test_a_tracking_error_shows_the_uri_once_redacted(
    tmp_path: Path, digits_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # a closed port: fail at once
    uri = "http://alice:USERPW@p@ss@127.0.0.1:9/"
    job = parse_spec(digits_spec(digits_dir, tmp_path, tracking={"mlflow": {"tracking_uri": uri}}))
    record = RunRecord(job, None)
    record.start()
    with pytest.raises(TrackingError) as excinfo:
        record.tracker()
    message = str(excinfo.value)
    _no_secret(message)
    assert "alice" not in message
    assert message.count("127.0.0.1:9") == 1, message
    assert message.startswith(
        f"tracking.mlflow.tracking_uri: cannot open an MLflow run at http://{REDACTED}@127.0.0.1:9/"
    )


def test_a_refused_resume_masks_credential_values(tmp_path: Path, digits_dir: Path) -> None:
    spec = parse_spec(_secret_spec(tmp_path, digits_dir))
    state = runstate.new_state(spec)
    new_db = "model.init_args.db=postgresql://db/x?password=QUERYPW2"
    changed = load_spec(
        spec, ["model.init_args.lr=0.1", "model.init_args.password=hunter3", new_db]
    )
    with pytest.raises(RunStateError) as excinfo:
        runstate.check_resumable(state, changed)
    message = str(excinfo.value)
    _no_secret(message)
    assert "hunter3" not in message and "QUERYPW2" not in message
    assert "model.init_args.lr: 0.003 -> 0.1" in message
    # only a credential changed: refused (the digest sees it), its value never shown
    only_secret = load_spec(spec, ["model.init_args.password=hunter3"])
    with pytest.raises(RunStateError) as excinfo:
        runstate.check_resumable(state, only_secret)
    message = str(excinfo.value)
    assert "hunter" not in message
    assert "a credential-like value changed" in message
    assert "model.init_args.password" in message
    # a state file written before redaction (the spec in clear) compares the same way
    state.spec = spec.flat()
    with pytest.raises(RunStateError) as excinfo:
        runstate.check_resumable(state, changed)
    _no_secret(str(excinfo.value))


def test_every_error_message_is_redacted(
    tmp_path: Path, digits_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from raytrain.cli import app as cli
    from raytrain.errors import SpecError
    from tests.conftest import write_spec

    assert SpecError(["a: https://alice:USERPW@h/x", "b: ok"]).problems == [
        f"a: https://{REDACTED}@h/x",
        "b: ok",
    ]
    spec = write_spec(tmp_path / "spec.yaml", digits_spec(digits_dir, tmp_path))
    bad = ["trainer.max_epochs=https://alice:USERPW@h/x", "model.init_args.password=hunter2"]
    assert cli.main(["validate", str(spec), *bad]) == 2
    err = capsys.readouterr().err
    assert "trainer.max_epochs" in err
    _no_secret(err)
