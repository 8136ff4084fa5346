"""An OpenAI-compatible HTTP gateway in front of the Kafka fleet, a trusted producer; its modules
are listed in docs/gateway.md.
"""
