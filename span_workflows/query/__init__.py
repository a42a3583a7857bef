"""The query layer: span queries as trees, how they are written and checked.

:mod:`~span_workflows.query.ir` (the nodes), :mod:`~span_workflows.query.builders` (``rag``,
``judge_generator``, ...), :mod:`~span_workflows.query.json_ir` (the JSON form),
:mod:`~span_workflows.query.validate`, :mod:`~span_workflows.query.pretty`,
:mod:`~span_workflows.query.sampling` (a G's sampling parameters),
:mod:`~span_workflows.query.span_options` (how spans are laid out and linked),
:mod:`~span_workflows.query.tool_prompt` and :mod:`~span_workflows.query.lift` (framework
prompts lifted back into span queries). It imports only the package's ground
(:mod:`span_workflows.errors`).
"""
