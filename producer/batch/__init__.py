"""Batch jobs in OpenAI's batch format, run on the Kafka fleet (docs/batch.md)."""
