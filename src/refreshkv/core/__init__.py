"""What a method is written against: the policy protocol, the selection base, the cache, the attention function,
the attention math and the stores. docs/adding-a-method.md walks through them."""
