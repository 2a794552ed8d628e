"""Who gets in, and when: API keys with their priority tier, in-flight slots per tier with a bounded wait
queue (this gateway's, or counted in Redis across gateways), the front door that answers 429/503 before a
request's body is read, and the turns in which admitted requests start their work."""
