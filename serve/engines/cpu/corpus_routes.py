"""SGLang 0.5.23's runtime corpus routes (`srt/entrypoints/http_server.py`, the tokenizer manager's
`add_external_corpus`/`remove_external_corpus`/`list_external_corpora`, `srt/speculative/external_corpus_manager.py`):

- `POST /add_external_corpus` `{"corpus_id"?, "file_path"? | "documents"?}` -> `{"success", "corpus_id", "message",
  "loaded_token_count"}`, 200 or 400. No id: a random hex id. A file is refused whole past the token limit; inline
  documents are cut there and the message says "(truncated: exceeded N token limit)". One load at a time: a second
  while one builds gets "Another corpus load is already in progress.". Unknown body fields: 400 with the TypeError.
- `POST /remove_external_corpus` `{"corpus_id"}` -> `{"success", "message"}`; removing an unknown id succeeds.
- `GET /list_external_corpora` -> `{"success", "corpus_token_counts", "message"}`.
Without NGRAM every route answers 400 "Ngram speculative decoding is not enabled.".

Tokenizing and building the automaton run in a worker thread, never on the event loop: a large corpus takes seconds
and requests keep streaming meanwhile (the decode worker drafts from the corpora's last published snapshot).
"""

from __future__ import annotations

import asyncio
import uuid
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse

from serve.ngram.corpus import ExternalCorpora
from serve.engines.cpu.engine import LoadedEngine, encoder_of
from serve.engines.cpu.speculators import NgramSpeculator
from serve.http_limits import BadJson, parse_json

__all__ = ["register_corpus_routes", "NOT_ENABLED", "LOAD_IN_PROGRESS"]

NOT_ENABLED = "Ngram speculative decoding is not enabled."
LOAD_IN_PROGRESS = "Another corpus load is already in progress."
_ADD_FIELDS = ("corpus_id", "file_path", "documents", "token_chunks")


def _corpora(engine: LoadedEngine) -> ExternalCorpora | None:
    speculator = engine.decoder.speculator
    return speculator.corpora if isinstance(speculator, NgramSpeculator) else None


def _answer(body: dict[str, Any], ok: bool) -> JSONResponse:
    return JSONResponse(body, status_code=200 if ok else HTTPStatus.BAD_REQUEST)


def _add_failed(message: str) -> JSONResponse:
    return _answer({"success": False, "corpus_id": "", "message": message, "loaded_token_count": 0}, False)


async def _json_object(http: HttpRequest) -> dict[str, Any] | str:
    """The body as a dict, or the message to answer with."""
    try:
        body = parse_json(await http.body())  # strict: deep nesting or a 5000-digit number is a 400, not a 500
    except BadJson as err:
        return f"body: {err}"
    if not isinstance(body, dict):
        return f"body: expected a JSON object, got {type(body).__name__}"
    return body


def register_corpus_routes(app: FastAPI, engine: LoadedEngine) -> None:
    loading = False  # SGLang's ExternalCorpusManager._pending_load: one build at a time

    @app.post("/add_external_corpus")
    async def add_external_corpus(http: HttpRequest) -> JSONResponse:
        nonlocal loading
        body = await _json_object(http)
        if isinstance(body, str):
            return _answer({"success": False, "message": body}, False)
        unknown = [key for key in body if key not in _ADD_FIELDS]
        if unknown:  # SGLang builds AddExternalCorpusReqInput(**body) and answers its TypeError
            return _answer({"success": False, "message": "AddExternalCorpusReqInput.__init__() got an unexpected "
                            f"keyword argument '{unknown[0]}'"}, False)
        corpora = _corpora(engine)
        if corpora is None:
            return _add_failed(NOT_ENABLED)
        corpus_id = body.get("corpus_id") or uuid.uuid4().hex
        file_path, documents = body.get("file_path"), body.get("documents")
        if file_path is None and documents is None:
            return _add_failed("Either file_path or documents must be provided.")
        if loading:
            return _add_failed(LOAD_IN_PROGRESS)
        encode = encoder_of(engine.tokenizer)
        loading = True
        try:
            if file_path is not None:
                loaded = await asyncio.to_thread(corpora.add_file, corpus_id, str(file_path), encode)
                truncated = False
            else:
                if not isinstance(documents, list):
                    return _add_failed(f"documents: expected a list of strings, got {type(documents).__name__}")
                loaded, truncated = await asyncio.to_thread(corpora.add_documents, corpus_id, documents, encode)
        except (ValueError, OSError) as err:
            return _add_failed(str(err))
        finally:
            loading = False
        message = f"Loaded corpus '{corpus_id}' with {loaded} tokens."
        if truncated:
            message += f" (truncated: exceeded {corpora.max_tokens} token limit)"
        return _answer({"success": True, "corpus_id": corpus_id, "message": message,
                        "loaded_token_count": loaded}, True)

    @app.post("/remove_external_corpus")
    async def remove_external_corpus(http: HttpRequest) -> JSONResponse:
        body = await _json_object(http)
        if isinstance(body, str):
            return _answer({"success": False, "message": body}, False)
        corpus_id = body.get("corpus_id")
        if not corpus_id:
            return _answer({"success": False, "message": "corpus_id is required."}, False)
        corpora = _corpora(engine)
        if corpora is None:
            return _answer({"success": False, "message": NOT_ENABLED}, False)
        corpora.remove(str(corpus_id))
        return _answer({"success": True, "message": f"Removed corpus '{corpus_id}'."}, True)

    @app.get("/list_external_corpora")
    async def list_external_corpora() -> JSONResponse:
        corpora = _corpora(engine)
        if corpora is None:
            return _answer({"success": False, "corpus_token_counts": {}, "message": NOT_ENABLED}, False)
        return _answer({"success": True, "corpus_token_counts": corpora.list(), "message": ""}, True)
