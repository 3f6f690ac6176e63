"""What a model wrote, read: tool calls in each model's syntax, and reasoning split from the answer."""
