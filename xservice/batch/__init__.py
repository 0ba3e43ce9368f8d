"""Durable offline batch jobs (OpenAI Files + Batches API).

``store`` keeps files, batches and per-line state in SQLite (WAL) next to the files on disk;
``lines`` parses input lines and runs one through the online serving code path; ``runner`` drives
jobs (validating → in_progress → finalizing → completed, or cancelling → cancelled) and resumes
them after a restart; ``service`` ties both to the app's lifespan.
"""
