"""Models and harnesses for tests and demos: small LLMs built without torch, and greedy loops to compare them."""
