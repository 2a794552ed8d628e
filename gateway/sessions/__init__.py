"""A request's session, from submission to its end: the checks, the SQL row, the spec in Redis and the start
(a Celery task or a start block), identical requests sharing one session, a stalled session revived, and the
end of an answer (cancelled when nobody reads it)."""
