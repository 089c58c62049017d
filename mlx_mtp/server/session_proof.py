"""What proves a disk-session entry (``session_store.py``): its digest, keyed or not.

A plain SHA-256 of the entry catches corruption (bit rot, truncation, a half write), not
forgery: anyone who can write the session directory can recompute it. With a key that
lives outside that directory (``serve --prompt-cache-key FILE``) the digest is an
HMAC-SHA256 under it: only holders of the key can write an entry this server restores.
An entry proven otherwise (no digest, a plain one, another key) is treated as absent and
deleted.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Optional

KEY_BYTES = 32


def entry_digest(header: dict, chunks, key: Optional[bytes] = None) -> str:
    """Digest of an entry: its header (canonical JSON, without the digest) then its data
    section, so no bit of the file can change unseen (layout offsets included);
    ``"sha256:<hex>"``, or ``"hmac-sha256:<hex>"`` under ``key``."""
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    h = hmac.new(key, text, "sha256") if key is not None else hashlib.sha256(text)
    for c in chunks:
        h.update(c)
    return f"{'hmac-sha256' if key is not None else 'sha256'}:{h.hexdigest()}"


def check_digest(header: dict, chunks, want: str, key: Optional[bytes] = None):
    """ValueError unless ``want`` is the entry's digest of the kind ``key`` asks for."""
    kind = "hmac-sha256" if key is not None else "sha256"
    if not want:
        raise ValueError("no digest (written by an older version)")
    if not want.startswith(kind + ":"):
        raise ValueError(f"proven by {want.split(':')[0]}, not {kind} (another key setting)")
    if not hmac.compare_digest(entry_digest(header, chunks, key), want):
        raise ValueError("digest mismatch (corrupted bytes, or another key)")


def load_key(path) -> bytes:
    """The secret in ``path``, created (32 random bytes, mode 0600) if it does not exist.
    OSError, or ValueError for a file others may read or that holds too few bytes."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
            raise ValueError(f"{path} must be a regular file only its owner can read (0600)")
        key = f.read()
    if len(key) < 16:
        raise ValueError(f"{path} holds {len(key)} bytes; a key needs at least 16")
    return key
