"""Secrets stay out of the records: secret values on the command line and in the config are
written as ``***``, ordinary keys that merely contain a secret word are written as they are."""

import subprocess
import sys
from pathlib import Path

import pytest

from distmetrics.redaction import is_secret_name, redact_argv, redact_mapping, redact_text

ROOT = Path(__file__).resolve().parents[1]
SECRETS = ("hf_SECRET1234", "sk-SECRET5678", "pw-SECRET9012", "gh-SECRET3456", "tok-SECRET7890")


@pytest.mark.parametrize("name", ["hf_token", "token", "--hf-token", "access_token", "HF_TOKEN", "api_key",
                                  "apiKey", "wandb_api_key", "WANDB_API_KEY", "private_key", "secret",
                                  "client_secret", "aws_secret_access_key", "password", "db_password",
                                  "--api-key", "apikey", "credentials", "--authtoken", "--hftoken", "--auth",
                                  "authorization", "--api_keys", "secretkey", "+hf_token"])
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize("name", ["flops_per_token", "num_tokens", "tokens_per_sec", "log_timers_to_tensorboard",
                                  "tokenizer_model", "--tokenizer-type", "max_tokens", "num_key_value_heads",
                                  "key_value_channels", "log_interval", "wandb_project", "monkey", "keyboard",
                                  "private_key_path", "--seq-length", "tensorboard_dir", "--eos-token", "pad_token",
                                  "--password-file", "hf_token_env", "auth_type", "--num-keys", "PWD", "--prompt_key",
                                  "--chosen_key", "--mm_use_im_patch_token", "--secret_sauce_version"])
def test_ordinary_names(name):
    assert not is_secret_name(name)


def test_argv_hides_secret_values_in_every_form_and_keeps_the_rest():
    argv = ["train.py", "--hf-token", "hf_SECRET1234", "--api-key=sk-SECRET5678", "--tokenizer-model", "gpt2",
            "--num-tokens", "4096", "WANDB_API_KEY=tok-SECRET7890", "flops_per_token=6e9",
            "--data", "https://alice:pw-SECRET9012@data.example.com/shards?token=gh-SECRET3456&split=train",
            "--token", "--steps", "10"]
    assert redact_argv(argv) == [
        "train.py", "--hf-token", "***", "--api-key=***", "--tokenizer-model", "gpt2", "--num-tokens", "4096",
        "WANDB_API_KEY=***", "flops_per_token=6e9",
        "--data", "https://alice:***@data.example.com/shards?token=***&split=train",
        "--token", "--steps", "10"]  # a secret flag given no value hides nothing else


def test_config_mappings_hide_only_secret_keys():
    values = {"flops_per_token": 6e9, "num_tokens": 10, "log_timers_to_tensorboard": True, "api_key": "abc",
              "nested": {"hf_token": "x", "n": 1, "url": "s3://k:pw-SECRET9012@bucket/p"}, "token": None}
    assert redact_mapping(values) == {
        "flops_per_token": 6e9, "num_tokens": 10, "log_timers_to_tensorboard": True, "api_key": "***",
        "nested": {"hf_token": "***", "n": 1, "url": "s3://k:***@bucket/p"}, "token": None}
    assert redact_text("no secret here: https://example.com/a?b=c") == "no secret here: https://example.com/a?b=c"


def test_secrets_inside_other_arguments_are_hidden_and_what_surrounds_them_kept():
    """Forms the command line carries secrets in that were written whole: a header, JSON, a connection string,
    Hydra's +key=, a nested --env=KEY=value, several pairs in one argument, a clone URL's token, a password
    holding '@', a fragment's token, and one-word option names."""
    argv = ["--header", "Authorization: Bearer S1", "Authorization=Bearer S2",
            "--extra", '{"api_key": "S3", "lr": 0.1}',
            "+hf_token=S4", "++hf_token=S4", "--env=HF_TOKEN=S5", "--overrides", "lr=1 hf_token=S6",
            "--conn", "AccountName=a;AccountKey=S7;EndpointSuffix=core", "--repo", "https://ghp_S8@github.com/o/r.git",
            "--db", "postgres://u:S9@x@host/db", "--u", "https://h/p#access_token=S10", "--hftoken", "S11",
            "--eos-token", "</s>", "ssh://git@github.com/o/r",
            "https://example.com/a?sigma=2&design=b&SignatureVersion=4&sig_level=3&oauth_signature=S12"]
    assert redact_argv(argv) == [
        "--header", "Authorization: ***", "Authorization=***", "--extra", '{"api_key": "***", "lr": 0.1}',
        "+hf_token=***", "++hf_token=***", "--env=HF_TOKEN=***", "--overrides", "lr=1 hf_token=***",
        "--conn", "AccountName=a;AccountKey=***;EndpointSuffix=core", "--repo", "https://***@github.com/o/r.git",
        "--db", "postgres://u:***@host/db", "--u", "https://h/p#access_token=***", "--hftoken", "***",
        "--eos-token", "</s>", "ssh://git@github.com/o/r",
        "https://example.com/a?sigma=2&design=b&SignatureVersion=4&sig_level=3&oauth_signature=***"]


def test_a_secret_value_with_spaces_is_hidden_whole_and_a_command_in_one_argument_word_by_word():
    """A first form of the text reading hid only a value's first word; a command in one argument (bash -c)
    hid its first secret only; a chain of = a thousand long raised RecursionError."""
    argv = ["--password=correct horse battery staple", "-c",
            "env HF_TOKEN=S1 torchrun train.py --hf_token S2 --wandb_api_key S3 --lr 1",
            "--json", '{"api_key": "S\\"4", "api_keys": ["S5", "S6"], "n": 1}', "-H", "X-Api-Key: S7",
            "https://host/p?api-key=S8&x=1", "--set=" + "k=" * 1000 + "v",
            "--json", '{"wandb": {"api_key": "S9"}, "eps": [{"name": "a", "token": "S10"}]}',
            "-H", "X-Goog-Api-Key: S11",
            "--export=ALL,HF_TOKEN=S12", "pretrained=x,token=S13", "-c", 'torchrun t.py --password "a b c" --lr 1',
            "--json", "{'api_key': 'S14'}", "-c", "cd /w; env HF_TOKEN=S15 torchrun t.py --lr 3e-4; echo done"]
    redacted = redact_argv(argv)
    assert redacted[9:] == [
        "--json", '{"wandb": {"api_key": "***"}, "eps": [{"name": "a", "token": "***"}]}', "-H", "X-Goog-Api-Key: ***",
        "--export=ALL,HF_TOKEN=***", "pretrained=x,token=***", "-c", "torchrun t.py --password *** --lr 1",
        "--json", "{'api_key': '***'}", "-c", "cd /w; env HF_TOKEN=*** torchrun t.py --lr 3e-4; echo done"]
    assert redacted[:8] == [
        "--password=***", "-c", "env HF_TOKEN=*** torchrun train.py --hf_token *** --wandb_api_key *** --lr 1",
        "--json", '{"api_key": "***", "api_keys": ***, "n": 1}', "-H", "X-Api-Key: ***",
        "https://host/p?api-key=***&x=1"]


def test_commands_quoted_in_commands_connection_strings_with_spaces_and_secret_objects_are_hidden():
    """A third reading's leaks: a command quoted inside a command, text after an apostrophe, a connection
    string with spaces, a secret member whose value is an object or a nested list, names Slack's, Azure's and
    MySQL's secrets have."""
    argv = ["-c", 'docker run img bash -c "torchrun t.py --hf_token S1 --lr 1"', "ssh n1 'torchrun t.py --api-key S2'",
            "--note", "user's run, --hf_token S3", "Server=tcp:x,1433;Initial Catalog=db;User ID=u;Password=S4;",
            '{"hf_token": {"value": "S5"}, "api_keys": [["S6"], ["S7"]], "n": 1}', "SLACK_USER_TOKEN=S8",
            "AZURE_PRIMARY_KEY=S9", "MYSQL_PWD=S10", "PWD=/home/u/run"]
    assert redact_argv(argv) == [
        "-c", 'docker run img bash -c "torchrun t.py --hf_token *** --lr 1"', "ssh n1 'torchrun t.py --api-key ***'",
        "--note", "user's run, --hf_token ***", "Server=tcp:x,1433;Initial Catalog=db;User ID=u;Password=***;",
        '{"hf_token": ***, "api_keys": ***, "n": 1}', "SLACK_USER_TOKEN=***", "AZURE_PRIMARY_KEY=***",
        "MYSQL_PWD=***", "PWD=/home/u/run"]
    assert redact_mapping({"sql": "Host=db; Port=5432; Password=S1"}) == {"sql": "Host=db; Port=5432; Password=***"}
    assert redact_argv(["ENV=HF_TOKEN=S1;WANDB_API_KEY=S2",
                        "-c", "export NCCL_DEBUG=INFO; HF_TOKEN=S3 torchrun t.py --lr 1",
                        'ssh n1 "HF_TOKEN=S4 torchrun t.py --lr 1"']) == [
        "ENV=HF_TOKEN=***", "-c", "export NCCL_DEBUG=INFO; HF_TOKEN=*** torchrun t.py --lr 1",
        'ssh n1 "HF_TOKEN=*** torchrun t.py --lr 1"']  # a command's ; is no connection string's


@pytest.mark.parametrize("arg", ["1.0 /data/key:value_text_document 0.5 /data/b", "/data/token=abc/shard_text_document",
                                 "/out/key=3", "token:a", "Answer with key: value format. token: 5",
                                 "+data.path=/a/token=1", "--stop_token=</s>", "--image_token=<image>",
                                 "--sort-key=seq_len", "--text_key=text", "sigma=2;design=b", "PWD=/home/u/run",
                                 "data.prompt_key=prompt", "--chosen_key=chosen", "--rng_key=0",
                                 "cd /w; torchrun train.py --nproc-per-node 8 --lr 3e-4; echo done"])
def test_ordinary_text_that_looks_like_pairs_is_kept(arg):
    """Paths, prompts and tokenizer options a reading of every name: value pair in every argument destroyed."""
    assert redact_argv([arg]) == [arg]


def test_a_config_error_hides_the_value_of_an_unknown_secret_key(tmp_path):
    """A shared config holding hf_token or wandb_api_key (keys the Monitor does not know) was refused quoting
    the value, on every rank's console; by keyword, in a file and as an override."""
    import distmetrics as dm

    (tmp_path / "c.yaml").write_text("log_interval: 5\nwandb_api_key: S1\n")
    for make in (lambda: dm.MetricsConfig(hf_token="S1"), lambda: dm.MetricsConfig(wandb={"api_key": "S1"}),
                 lambda: dm.MetricsConfig.from_yaml(str(tmp_path / "c.yaml")),
                 lambda: dm.MetricsConfig.from_yaml(str(tmp_path / "c.yaml"), ["hf_token=S1"])):
        with pytest.raises(dm.ConfigError) as info:
            make()
        assert "S1" not in str(info.value) and "unknown config key" in str(info.value), info.value
    with pytest.raises(dm.ConfigError, match=r"^override 'hf_token=\*\*\*': unknown config key 'hf_token';"):
        dm.MetricsConfig.from_yaml(str(ROOT / "configs" / "metrics.yaml"), ["hf_token=S1"])


def test_the_signatures_of_pre_signed_urls_are_hidden():
    """An S3, GCS or Azure pre-signed URL's signature grants access until it expires: it was written whole."""
    urls = ["https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA123&X-Amz-Signature=DEADBEEF&X-Amz-Expires=3600",
            "https://a.blob.core.windows.net/c/f?sv=2022-11-02&sig=SASSIG&se=2026-12-01",
            "https://storage.googleapis.com/b/o?X-Goog-Signature=GSIG&X-Goog-SignedHeaders=host"]
    assert redact_argv(["--data", *urls]) == [
        "--data", "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Expires=3600",
        "https://a.blob.core.windows.net/c/f?sv=2022-11-02&sig=***&se=2026-12-01",
        "https://storage.googleapis.com/b/o?X-Goog-Signature=***&X-Goog-SignedHeaders=host"]
    assert redact_mapping({"data_url": urls[1], "signature_version": "v4"}) == {
        "data_url": "https://a.blob.core.windows.net/c/f?sv=2022-11-02&sig=***&se=2026-12-01",
        "signature_version": "v4"}  # a config key is no query parameter


SCRIPT = """
import sys
import distmetrics as dm
cfg = dm.MetricsConfig(output_dir=sys.argv[1], log_interval=1, console=False, flops_per_token=6e9,
                       wandb_project="secrets", wandb_mode="offline")
with dm.Monitor(cfg) as monitor:
    monitor.step(1, loss=1.0, tokens=10)
"""


def test_no_secret_reaches_any_file_of_the_run_and_ordinary_keys_stay(tmp_path):
    """A real run (JSONL, TensorBoard, progress.txt, W&B offline) started with secrets on its
    command line: no file under output_dir holds one; flops_per_token is written as it is."""
    import distmetrics as dm

    out = tmp_path / "run"
    args = [str(out), "--hf-token", SECRETS[0], "--api-key=" + SECRETS[1], "--seq-length", "128",
            "--data", f"https://alice:{SECRETS[2]}@data.example.com/x?token={SECRETS[3]}",
            f"HF_TOKEN={SECRETS[4]}"]
    run = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files) and (out / "metrics.jsonl").exists()
    for path in files:
        data = path.read_bytes()
        for secret in SECRETS:
            assert secret.encode() not in data, f"{secret} in {path}"
    record = next(dm.read_jsonl(out / "metrics.jsonl"))
    assert record["argv"][1:] == [str(out), "--hf-token", "***", "--api-key=***", "--seq-length", "128", "--data",
                                  "https://alice:***@data.example.com/x?token=***", "HF_TOKEN=***"]
    assert record["config"]["flops_per_token"] == 6e9
    from tests.wandb_reader import read_offline_run

    assert read_offline_run(str(out))["config"]["flops_per_token"] == 6e9


def test_an_error_w_and_b_logged_is_said_without_the_secrets_in_it(tmp_path):
    """The wandb sink repeats the error W&B's service logged: an upload's pre-signed URL in it was said whole.
    The sink is made without W&B (its run stood in for by the two attributes read: the narrowest boundary)."""
    import json
    from types import SimpleNamespace

    from distmetrics.sinks.wandb import WandbSink

    log = tmp_path / "debug-internal.log"
    url = "https://b.s3.amazonaws.com/f?X-Amz-Credential=AKIA1&X-Amz-Signature=S1&X-Amz-Expires=60"
    line = {"level": "ERROR", "msg": f"upload failed: PUT {url}: 403"}
    log.write_text(json.dumps(line, separators=(",", ":")) + "\n")  # compact, as W&B writes its log
    sink = object.__new__(WandbSink)
    sink.run, sink._log_offset = SimpleNamespace(settings=SimpleNamespace(log_internal=str(log))), 0
    said = sink._logged_error()
    assert "S1" not in said and "AKIA1" not in said and "X-Amz-Signature=***" in said and "403" in said, said
