"""A local stand-in for the Hugging Face Hub's upload endpoints, for tests (the Hub cannot be reached from CI here).

`install(record_dir)` replaces two methods of `huggingface_hub.HfApi` at the class level, so every instance sees them:
transformers' shared `hf_api()` (used by `Trainer.push_to_hub` / `init_hf_repo`) as well as a plain `HfApi()`.

- `create_repo(repo_id, ...)`: no request; returns the `RepoUrl` the Hub would, with a bare name put under the
  namespace ``tester`` (the Hub puts it under the token's user).
- `upload_folder(repo_id=..., folder_path=..., ...)`: no request; records what would be committed. The files are
  chosen as `HfApi.upload_folder` chooses them, with huggingface_hub's own `filter_repo_objects` over the folder's
  files (`allow_patterns`, `ignore_patterns` plus its `DEFAULT_IGNORE_PATTERNS`), and copied, as they are at call
  time, to ``record_dir/upload-N/files/``; the call's other arguments go to ``record_dir/upload-N/call.json``.

Everything before these two calls (saving, the model card, the choice of folder and patterns) is the real code path;
only the HTTP requests are replaced. `read_uploads(record_dir)` returns the recorded uploads in call order.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

NAMESPACE = "tester"
ENDPOINT = "https://huggingface.co"


def _full_repo_id(repo_id: str) -> str:
    return repo_id if "/" in repo_id else f"{NAMESPACE}/{repo_id}"


def install(record_dir: str | Path, monkeypatch=None) -> None:
    """Replace `HfApi.create_repo` and `HfApi.upload_folder` (through pytest's `monkeypatch` when given, so that they
    are restored after the test; for good in a notebook kernel)."""
    from huggingface_hub import CommitInfo, HfApi, RepoUrl
    from huggingface_hub.hf_api import DEFAULT_IGNORE_PATTERNS
    from huggingface_hub.utils import filter_repo_objects

    record_dir = Path(record_dir)
    record_dir.mkdir(parents=True, exist_ok=True)

    def create_repo(self, repo_id: str, *, token=None, private=None, repo_type=None, exist_ok=False, **kwargs):
        return RepoUrl(f"{ENDPOINT}/{_full_repo_id(repo_id)}", endpoint=ENDPOINT)

    def upload_folder(self, *, repo_id: str, folder_path, path_in_repo=None, allow_patterns=None,
                      ignore_patterns=None, delete_patterns=None, **kwargs):  # fmt: skip
        folder = Path(folder_path)
        ignore = [ignore_patterns] if isinstance(ignore_patterns, str) else list(ignore_patterns or [])
        files = sorted(p.relative_to(folder).as_posix() for p in folder.glob("**/*") if p.is_file())
        effective = ignore + DEFAULT_IGNORE_PATTERNS  # HfApi.upload_folder adds them too
        chosen = list(filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=effective))
        target = record_dir / f"upload-{len(list(record_dir.glob('upload-*')))}"
        for name in chosen:
            (target / "files" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(folder / name, target / "files" / name)
        (target / "files").mkdir(parents=True, exist_ok=True)
        call = {
            "repo_id": repo_id,
            "folder_path": str(folder),
            "path_in_repo": path_in_repo,
            "allow_patterns": allow_patterns,
            "ignore_patterns": ignore,
            "delete_patterns": delete_patterns,
            "files": chosen,
            **{k: v for k, v in kwargs.items() if isinstance(v, (str, int, float, bool, type(None)))},
        }
        (target / "call.json").write_text(json.dumps(call, indent=2))
        oid = f"{len(chosen):040d}"
        return CommitInfo(
            commit_url=f"{ENDPOINT}/{repo_id}/commit/{oid}",
            commit_message=kwargs.get("commit_message") or "",
            commit_description="",
            oid=oid,
        )

    for name, fake in (("create_repo", create_repo), ("upload_folder", upload_folder)):
        if monkeypatch is not None:
            monkeypatch.setattr(HfApi, name, fake)
        else:
            setattr(HfApi, name, fake)


def read_uploads(record_dir: str | Path) -> list[dict[str, Any]]:
    """The recorded uploads, in call order: the call's arguments plus ``dir``, the folder holding its files."""
    record_dir = Path(record_dir)
    uploads = []
    for target in sorted(record_dir.glob("upload-*"), key=lambda p: int(p.name.split("-")[1])):
        uploads.append({**json.loads((target / "call.json").read_text()), "dir": target / "files"})
    return uploads
