"""The engine: joins the scheduler and the model runner; input and output processing; the offline `LLM`."""
