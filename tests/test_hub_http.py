"""Hub download for real: a local HTTP server on 127.0.0.1 answers as the hub does, and we count what is fetched."""

from __future__ import annotations

import hashlib
import json
import threading
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
REPO = "acme/sharded-bert"


class FakeHub(BaseHTTPRequestHandler):
    """Serves /{org}/{name}/resolve/{revision}/{file} from one folder, with the hub's headers and error codes; `fail`:
    (method, file) -> an HTTP status to answer instead, or "cut" to drop the connection mid-body."""

    fail: dict = {}

    def __init__(self, folder: Path, log: list, *args, **kwargs):
        self.folder, self.log = folder, log
        super().__init__(*args, **kwargs)

    def log_message(self, *args) -> None:  # keep pytest's output clean
        pass

    def _answer(self, with_body: bool) -> None:
        parts = self.path.split("?")[0].strip("/").split("/")
        if "/".join(parts[:2]) != REPO or parts[2:3] != ["resolve"]:
            return self._error(404, "RepoNotFound")
        path = self.folder / "/".join(parts[4:])
        if not path.is_file():
            return self._error(404, "EntryNotFound")
        data = path.read_bytes()
        self.log.append((self.command, path.name, parts[3]))
        if (failure := self.fail.get((self.command, path.name))) not in (None, "cut"):
            return self._error(failure, "")
        self.send_response(200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if with_body:
            self.wfile.write(data[: len(data) // 2] if failure == "cut" else data)

    def _error(self, code: int, kind: str) -> None:
        self.send_response(code)
        self.send_header("X-Error-Code", kind)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_HEAD(self) -> None:  # noqa: N802 (http.server's naming)
        self._answer(with_body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(with_body=True)


@pytest.fixture()
def hub(tmp_path):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(hidden_size=128, num_hidden_layers=8, intermediate_size=512, num_attention_heads=2))
    model.save_pretrained(tmp_path / "repo", max_shard_size="4MB")
    log: list = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(FakeHub, tmp_path / "repo", log))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield tmp_path, f"http://127.0.0.1:{server.server_port}", log, model
    server.shutdown()
    server.server_close()


def test_downloads_only_config_index_and_embedding_shards(hub, hub_home):
    from bertembed import BertEmbeddings

    root, endpoint, log, model = hub
    hub_home(root / "home", endpoint)
    layer = BertEmbeddings.from_pretrained(REPO)
    for key, value in model.embeddings.state_dict().items():
        assert torch.equal(layer.state_dict()[key], value), key
    index = json.loads((root / "repo" / "model.safetensors.index.json").read_text())
    embedding_shards = {v for k, v in index["weight_map"].items() if k.startswith("embeddings.")}
    fetched = {name for method, name, _ in log if method == "GET"}
    # every file after config.json from the commit it came from: a branch that moved would not mix two checkpoints
    assert [revision for method, name, revision in log if method == "GET" and name != "config.json"] == \
        [COMMIT] * (len(fetched) - 1) and layer.source.revision == COMMIT
    assert fetched == {"config.json", "model.safetensors.index.json", *embedding_shards}
    assert len(set(index["weight_map"].values())) > len(embedding_shards)  # other shards existed and were skipped
    hub_home(root / "home")  # the second load is served from the cache, even with the hub unreachable
    assert torch.equal(BertEmbeddings.from_pretrained(REPO).word_embeddings.weight, layer.word_embeddings.weight)


def test_unknown_repo_says_so(hub, hub_home):
    from typer.testing import CliRunner

    from bertembed.cli import app

    root, endpoint, _, _ = hub
    hub_home(root / "home", endpoint)
    done = CliRunner().invoke(app, ["explain", "hi", "--model", "acme/nothing-here"])
    assert done.exit_code == 2 and "no hub model 'acme/nothing-here'" in done.output, done.output


@pytest.mark.parametrize("failure", [500, "cut"])
def test_a_failed_download_is_one_line_and_exit_status_2(hub, hub_home, monkeypatch, failure):
    """A server error, or a connection dropped mid-file, ended the command in a traceback."""
    from typer.testing import CliRunner

    from bertembed.cli import app

    root, endpoint, _, _ = hub
    hub_home(root / "home", endpoint)
    monkeypatch.setattr(FakeHub, "fail", {("GET", "model.safetensors.index.json"): failure})
    done = CliRunner().invoke(app, ["inspect", "positions", "--model", REPO])
    message = " ".join(done.output.split())
    assert done.exit_code == 2 and "cannot fetch model.safetensors.index.json of hub model" in message, done.output


def test_a_revision_with_a_local_path_is_refused(tmp_path, monkeypatch, bundled_path):
    from bertembed import BertEmbeddings

    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme" / "tiny").symlink_to(bundled_path)  # (a folder named like the hub id)
    with pytest.raises(ValueError, match="revision='dev' names a hub revision, but 'acme/tiny' is a local folder"):
        BertEmbeddings.from_pretrained("acme/tiny", revision="dev")
