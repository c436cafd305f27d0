"""`dsc datastore`: add a lookup datastore to a bundle, built from the bundle's own main
model's greedy outputs on a prompt file (runtime/bundle/datastore.py says how it drafts).

The main decodes every prompt plainly (no speculation), so the store records exactly what
this bundle writes; the store then goes in beside the models and the manifest lists it with
its hash. Both files are written to temp paths and renamed, the manifest last: a crash
leaves the bundle as it was (an unlisted store is never read).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from dspark.runtime.bundle.bundle import MANIFEST_FILE, dump_json, file_entry, open_bundle
from dspark.runtime.bundle.datastore import STORE_FILE, Datastore
from dspark.runtime.errors import DSparkError


@dataclass(frozen=True)
class StoreReport:
    prompts: int
    tokens: int  # generated
    entries: int
    bytes: int


def build_datastore(bundle_path: Path, prompts_path: Path, max_tokens: int = 256,
                    max_n: int = 4, batch: int = 8) -> StoreReport:
    from dspark.runtime.api import load_engine
    from dspark.runtime.sequence.prompt import entry_ids, load_prompts
    from dspark.runtime.sequence.request import GenerationRequest
    from dspark.runtime.sequence.sampling import SamplingParams

    prompts = load_prompts(prompts_path)
    engine, tokenizer = load_engine(bundle_path, watch=False)
    if tokenizer is None and any("prompt_ids" not in p for p in prompts):
        raise DSparkError(f"{bundle_path}: the bundle has no tokenizer; give the prompts in "
                          f"{prompts_path} as 'prompt_ids'")
    ids = [entry_ids(tokenizer, p) for p in prompts]
    streams = []
    for start in range(0, len(ids), batch):
        requests = [GenerationRequest(tuple(x), max_tokens, SamplingParams(0.0),
                                      speculative=False) for x in ids[start:start + batch]]
        streams += [list(r.prompt_ids) + seq.generated
                    for r, seq in zip(requests, engine.generate(requests))]
    store = Datastore.build(streams, max_n)
    root = Path(bundle_path)
    store.save(root / STORE_FILE)
    bundle = open_bundle(root, verify=False)
    manifest = bundle.manifest
    flags = {**manifest.flags, "datastore": {
        "prompts": prompts_path.name, "prompts_sha256": hashlib.sha256(
            prompts_path.read_bytes()).hexdigest(), "count": len(prompts),
        "max_tokens": max_tokens, "max_n": max_n, "entries": len(store)}}
    manifest = dataclasses.replace(manifest, flags=flags, files={
        **manifest.files, STORE_FILE: file_entry(root / STORE_FILE)})
    tmp = root / f".{MANIFEST_FILE}.{os.getpid()}.tmp"
    tmp.write_bytes(dump_json(manifest.to_dict()))
    os.replace(tmp, root / MANIFEST_FILE)
    generated = sum(len(s) for s in streams) - sum(len(x) for x in ids)
    return StoreReport(len(prompts), generated, len(store), (root / STORE_FILE).stat().st_size)
