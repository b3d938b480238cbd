"""ONNX op types the torch reference implements, importable without torch.

Bidding asks "can you run this op?" thousands of times; importing torch for
that would cost seconds. A test keeps this set equal to the kernel table.
"""

TORCH_KERNEL_OPS: frozenset[str] = frozenset({
    'Abs', 'Add', 'And', 'AveragePool', 'BatchNormalization', 'Cast', 'Ceil', 'Clip',
    'Concat', 'Constant', 'ConstantOfShape', 'Conv', 'Cos', 'CumSum', 'Div', 'Equal',
    'Erf', 'Exp', 'Expand', 'Flatten', 'Floor', 'Gather', 'GatherElements', 'GatherND',
    'Gelu', 'Gemm', 'GlobalAveragePool', 'Greater', 'GreaterOrEqual', 'HardSigmoid', 'Identity', 'IsNaN',
    'LayerNormalization', 'LeakyRelu', 'Less', 'LessOrEqual', 'Log', 'LogSoftmax', 'MatMul', 'Max',
    'MaxPool', 'Mean', 'Min', 'Mul', 'Neg', 'Not', 'Or', 'Pow',
    'Range', 'Reciprocal', 'ReduceMax', 'ReduceMean', 'ReduceMin', 'ReduceSum', 'Relu', 'Reshape',
    'Round', 'Shape', 'Sigmoid', 'Sign', 'Sin', 'Slice', 'Softmax', 'Softplus',
    'Split', 'Sqrt', 'Squeeze', 'Sub', 'Sum', 'Tanh', 'Tile', 'Transpose',
    'Trilu', 'Unsqueeze', 'Where', 'Xor',
})
