"""The compiler layer: a query's tree made into the token form the engine runs.

:mod:`~span_workflows.compiler.optimize` (normal form and the tree a query runs as),
:mod:`~span_workflows.compiler.locality` (the attention-locality tournament),
:mod:`~span_workflows.compiler.compile` (block-aligned tokens and span boundaries),
:mod:`~span_workflows.compiler.render` (chat templates), :mod:`~span_workflows.compiler.keys`
(the span keys routers read) and :mod:`~span_workflows.compiler.model` (which model and
tokenizer). Pure functions of the query and the tokenizer: no engine, no I/O but the model's
files.
"""
