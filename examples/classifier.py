"""A digit classifier as people write one: scikit-learn trains an MLPClassifier on the 8x8 digits
it ships (no download), hexir compiles the trained weights with a softmax at the end, and on the
held-out quarter hexir's predictions are exactly scikit-learn's `predict` and its probabilities
`predict_proba`'s to 12 significant digits (float64, as scikit-learn trains).

    python examples/classifier.py [FOLDER]   # writes classifier.hxb, classifier_x.npy next to itself (or in FOLDER)
    hexir-run examples/classifier.hxb --input x=examples/classifier_x.npy

classifier.hxb serves any batch size; its outputs are each row's class index (int64: the digit,
as the digits' classes are 0-9) and the ten probabilities. float32 weights give the same
predictions on this split too (the example checks it and prints the smallest gap between a row's
two largest logits, far above float32's rounding), but only float64 is equal whatever the input,
so the exported module is float64. scikit-learn is this example's dependency (the dev install
brings it, and threadpoolctl with it), never the runtime's.
"""

import os
import sys
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier
from threadpoolctl import threadpool_limits

import hexir

digits = load_digits()
x_train, x_test, y_train, y_test = train_test_split(digits.data / 16.0, digits.target, test_size=0.25,
                                                    random_state=0)
net = MLPClassifier(hidden_layer_sizes=(64,), activation="relu", learning_rate_init=0.01, max_iter=300,
                    random_state=0)  # converges in about 100 epochs, so no ConvergenceWarning
# One BLAS thread: the same weights on every run (the thread count changes the sums' rounding),
# and seconds, not a minute, on a busy 2-core machine, where threads wait on each other.
with threadpool_limits(limits=1):
    net.fit(x_train, y_train)


def hexir_classifier(W1, b1, W2, b2):
    """scikit-learn's forward pass (a relu hidden layer, a softmax output) as a hexir function of
    the weights given: each row's class index (int64) and its class probabilities."""
    @hexir.jit
    def classify(x):
        logits = hexir.linear(hexir.relu(hexir.linear(x, W1, b1)), W2, b2)
        return hexir.argmax(logits), hexir.softmax(logits)
    return classify


(W1, W2), (b1, b2) = net.coefs_, net.intercepts_
classify = hexir_classifier(W1, b1, W2, b2)  # float64, as scikit-learn trained them


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    expected, expected_probabilities = net.predict(x_test), net.predict_proba(x_test)
    classes, probabilities = classify(x_test)
    assert (net.classes_[classes] == expected).all(), "hexir's predictions differ from scikit-learn's"
    np.testing.assert_allclose(probabilities, expected_probabilities, rtol=1e-12, atol=0)
    print(f"scikit-learn: {net.n_iter_} epochs; on the {len(x_test)} held-out digits accuracy "
          f"{net.score(x_test, y_test):.3f}, the first ten predicted {expected[:10].tolist()}")
    print(f"hexir float64: all {len(x_test)} predictions equal scikit-learn's, probabilities within "
          f"{np.max(np.abs(probabilities / expected_probabilities - 1)):.1e} relative")

    classify32 = hexir_classifier(*(w.astype(np.float32) for w in (W1, b1, W2, b2)))
    classes32, probabilities32 = classify32(x_test.astype(np.float32))
    assert (net.classes_[classes32] == expected).all(), "hexir's float32 predictions differ from scikit-learn's"
    np.testing.assert_allclose(probabilities32, expected_probabilities, rtol=0, atol=1e-5)
    top2 = np.sort(np.maximum(x_test @ W1 + b1, 0) @ W2 + b2, axis=1)[:, -2:]  # each row's two largest logits
    print(f"hexir float32: all {len(x_test)} predictions equal too (a row's two largest logits are "
          f"{np.min(top2[:, 1] - top2[:, 0]):.2f} or more apart), probabilities within "
          f"{np.max(np.abs(probabilities32 - expected_probabilities)):.1e} absolute")

    # one module for every batch size: the leading extent is the symbol "batch"
    path = hexir.export(classify, out / "classifier.hxb", hexir.TensorSpec(("batch", 64), "float64"))
    np.save(out / "classifier_x.npy", x_test[:5])
    here = os.path.relpath  # paths as the reader would type them
    print(f"wrote {here(path)}; run it with: hexir-run {here(path)} --input x={here(out / 'classifier_x.npy')}")
