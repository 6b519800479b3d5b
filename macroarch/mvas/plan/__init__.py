"""Planning which tensor is stored in which format: importance estimates (``importance``), plans from rules or a
memory budget (``policy``), the post's CLIP precision policy (``precision_policy``), and the re-planning schedule
(``schedule``, which works on a store)."""
