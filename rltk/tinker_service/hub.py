"""The served tokenizer, given to clients over the Hugging Face Hub's download protocol.

The SDK's ``get_tokenizer()`` (training and sampling clients alike) and tinker-cookbook's
``get_tokenizer(model_name)`` run ``AutoTokenizer.from_pretrained(<served name>)``. This service
answers that lookup itself: a client that sets ``HF_ENDPOINT=<TINKER_BASE_URL>/hub`` (and, when the
service has API keys, ``HF_TOKEN=<its key>``) downloads the served tokenizer's files from the
service, on any machine, with nothing shared but the connection.

The files are the served tokenizer saved with ``save_pretrained``, the model's ``config.json``, and
the ``auto_map`` that makes plain ``AutoTokenizer`` load a generic tokenizer verbatim
(:func:`rltk.models.loading.make_auto_tokenizer_exact`, the one rltk's exported checkpoints carry):
without it transformers rebuilds e.g. the tiny model's character tokenizer as a ``Qwen2Tokenizer``
with a byte-level pre-tokenizer, and every space is lost. They are written once, at start, into
``<state-dir>/served-tokenizer`` and served read-only; their revision is the digest of their
contents, so a client's Hub cache never mixes two servers' tokenizers.

Routes (under ``/hub``, as ``huggingface_hub`` 0.20+ requests them):
``HEAD|GET /hub/{name}/resolve/{revision}/{file}`` and ``GET /hub/api/models/{name}[/revision/{revision}]``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

HUB_PREFIX = "/hub"


@dataclass(frozen=True)
class ServedTokenizer:
    """The files a client downloads, their digests and the revision that names them all."""

    name: str
    folder: Path
    files: dict[str, bytes]
    commit: str

    @classmethod
    def write(cls, name: str, tokenizer, model_config, folder: Path) -> "ServedTokenizer":
        """Save ``tokenizer`` (and ``model_config`` as config.json) into ``folder`` for ``name``."""
        from rltk.models.loading import make_auto_tokenizer_exact

        folder.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(folder))
        if model_config is not None:
            model_config.to_json_file(str(folder / "config.json"))
        make_auto_tokenizer_exact(folder)
        files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
        digest = hashlib.sha1()
        for filename, content in files.items():
            digest.update(filename.encode() + b"\0" + hashlib.sha256(content).digest())
        return cls(name, folder, files, digest.hexdigest())


def _not_found(code: str, message: str):
    from fastapi.responses import JSONResponse

    # huggingface_hub reads X-Error-Code: EntryNotFound is an optional file that is absent
    return JSONResponse({"error": message}, status_code=404, headers={"X-Error-Code": code,
                                                                     "X-Error-Message": message})


def add_hub_routes(app, served: ServedTokenizer) -> None:
    """The Hub download routes for ``served`` (see the module docstring)."""
    from fastapi.responses import JSONResponse, Response

    def unknown(name: str):
        return _not_found("RepoNotFound", f"this service serves the tokenizer of {served.name!r} only, not "
                                          f"{name!r} (HF_ENDPOINT points at rltk serve-tinker)")

    @app.api_route(HUB_PREFIX + "/{name:path}/resolve/{revision}/{filename:path}", methods=["GET", "HEAD"])
    async def resolve(name: str, revision: str, filename: str):
        if name != served.name:
            return unknown(name)
        content = served.files.get(filename)
        if content is None:
            return _not_found("EntryNotFound", f"{filename} is not among the served tokenizer's files "
                                               f"({', '.join(served.files)})")
        etag = f'"{hashlib.sha256(content).hexdigest()}"'
        return Response(content=content, media_type="application/octet-stream",
                        headers={"X-Repo-Commit": served.commit, "ETag": etag})

    @app.get(HUB_PREFIX + "/api/models/{name:path}")
    async def model_info(name: str):
        if "/tree/" in name:  # a folder listing (transformers asks for additional_chat_templates): none here
            return JSONResponse([]) if name.partition("/tree/")[0] == served.name else unknown(name)
        repo = name.partition("/revision/")[0]
        if repo != served.name:
            return unknown(repo)
        return JSONResponse({"id": served.name, "modelId": served.name, "sha": served.commit, "private": False,
                             "siblings": [{"rfilename": f} for f in served.files]})
