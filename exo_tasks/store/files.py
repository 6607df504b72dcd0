"""Files (OpenAI's Files API) in Redis, so that every API process and every host sees them:
the metadata in a hash, the bytes in a string beside it, the ids in a list by creation time."""

from __future__ import annotations

from exo_tasks.batch_types import FileObject
from exo_tasks.store.client import RedisPart
from exo_tasks.store.keys import FILES, file_key


class FileRecords(RedisPart):
    def put(self, meta: FileObject, content: str) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(file_key(meta.id, "content"), content)
        pipe.hset(file_key(meta.id), "meta", meta.model_dump_json())
        pipe.zadd(FILES, {meta.id: meta.created_at})
        pipe.execute()

    def get(self, file_id: str) -> FileObject | None:
        raw = self.redis.hget(file_key(file_id), "meta")
        return FileObject.model_validate_json(raw) if raw else None

    def content(self, file_id: str) -> str | None:
        content: str | None = self.redis.get(file_key(file_id, "content"))
        return content

    def exists(self, file_id: str) -> bool:
        return bool(self.redis.exists(file_key(file_id, "content")))

    def page(self, after: str | None, limit: int) -> tuple[list[FileObject], bool] | None:
        """Files newest first, from the one after `after`; whether more follow. None if
        `after` is unknown."""
        page = self.newest_after(FILES, after, limit)
        if page is None:
            return None
        ids, more = page
        pipe = self.redis.pipeline(transaction=False)
        for file_id in ids:
            pipe.hget(file_key(file_id), "meta")
        files = [FileObject.model_validate_json(raw) for raw in pipe.execute() if raw]
        return files, more

    def delete(self, file_id: str) -> bool:
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(file_key(file_id), file_key(file_id, "content"))
        pipe.zrem(FILES, file_id)
        deleted, _ = pipe.execute()
        return bool(deleted)
