"""The model as graphopt holds it: the IR over onnx-graphsurgeon (``ir``) and what reads and
writes it — loading, validation and external data (``io``), opset upgrades, what onnxruntime
accepts that onnx does not (``compat``), spooled files, and the analyses rules ask (shapes and
values ``analysis``, symbolic dims ``dims``, domains, quantized-tensor boundaries ``quant``).

May import: ``opt.errors``, ``opt.remarks`` and this package; nothing else of graphopt.
"""
