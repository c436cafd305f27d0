"""Which replica a request prefers: one routing key per tenant (else per conversation), placed
by rendezvous hashing, so every router (one per ingress replica and proxy) agrees without
sharing state, and a replica that leaves moves only its own keys.

    key = "tenant:<X-Tenant-ID>"           a tenant's DFlash state and lookup corpus stay warm
        | "session:<X-Session-ID>"         Ray Serve's session header, when there is no tenant
        | "conversation:<hash>"            the system + first user message (or prompt head)
        | None                             least loaded

    rank(key) = [[first replica in hash order whose queue is within `imbalance` of the
                  shortest], [the others]]
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

PROMPT_HEAD_CHARS = 512  # a completion prompt's head that names its conversation


def route_key(headers: Mapping[str, str], body: bytes) -> str | None:
    """The routing key of one request (header names lower-case)."""
    if tenant := headers.get("x-tenant-id"):
        return f"tenant:{tenant}"
    if session := headers.get("x-session-id"):
        return f"session:{session}"
    head = _conversation_head(body)
    if head is None:
        return None
    return "conversation:" + hashlib.blake2b(head.encode(), digest_size=12).hexdigest()


def _conversation_head(body: bytes) -> str | None:
    """What stays the same across the turns of one conversation: the messages up to and
    including the first user message (chat), or the prompt's head (completions)."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(request, dict):
        return None
    messages = request.get("messages")
    if isinstance(messages, list) and messages:
        first_user = next((i for i, m in enumerate(messages)
                           if isinstance(m, dict) and m.get("role") == "user"), 0)
        return json.dumps(messages[: first_user + 1], sort_keys=True)
    prompt = request.get("prompt")
    if isinstance(prompt, list):
        prompt = json.dumps(prompt[:PROMPT_HEAD_CHARS])
    return prompt[:PROMPT_HEAD_CHARS] if isinstance(prompt, str) and prompt else None


def _weight(key: str, replica: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank(key: str | None, replicas: Sequence[str], loads: Mapping[str, int | None],
         imbalance: int) -> list[list[str]]:
    """Replica ids in preference groups (Ray Serve tries a group, then the next). `loads`:
    each replica's queue length where known. No key: one group, the router picks the
    shortest queue. A preferred replica more than `imbalance` requests above the shortest
    queue passes its turn to the next replica in hash order."""
    if key is None or len(replicas) < 2:
        return [list(replicas)] if replicas else []
    order = sorted(replicas, key=lambda r: _weight(key, r), reverse=True)
    known = [n for r in replicas if (n := loads.get(r)) is not None]
    floor = min(known, default=0)
    chosen = next((r for r in order if (loads.get(r) or 0) - floor <= imbalance), order[0])
    return [[chosen], [r for r in order if r != chosen]]
