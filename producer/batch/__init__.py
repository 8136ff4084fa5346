"""Batch jobs in OpenAI's batch format, run on the Kafka fleet (docs/batch.md).

    lines.py    input lines -> checked BatchLines (or an error naming the line and the field);
                request ids derived from the batch and the line; output lines in OpenAI's format
    runner.py   one batch's life on Kafka: what earlier runs already got back (the batch's own
                reply topic), what to send, bounded in flight, retries of shed load
    local.py    `inferline batch run`: the output file, its state file (resume), the progress bar
"""
