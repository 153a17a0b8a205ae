"""A digit classifier as people write one: scikit-learn trains an MLPClassifier on the digits
that scikit-learn ships (no download), hexir compiles its weights with a softmax at the end,
and the predictions and probabilities on the held-out split are scikit-learn's own.

    python examples/classifier.py [FOLDER]   # writes classifier.hxb, classifier_x.npy (or into FOLDER)
    hexir-run examples/classifier.hxb --input x=examples/classifier_x.npy

scikit-learn is the example's dependency (the dev install has it), never the runtime's.
"""

import os
import sys
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier

import hexir

digits = load_digits()
x_train, x_test, y_train, y_test = train_test_split(digits.data / 16.0, digits.target, test_size=0.25,
                                                    random_state=0)
net = MLPClassifier(hidden_layer_sizes=(64,), activation="relu", max_iter=300, random_state=0)
net.fit(x_train, y_train)
(W1, W2), (b1, b2) = net.coefs_, net.intercepts_  # float64, as scikit-learn trained them


@hexir.jit
def classify(x):
    logits = hexir.linear(hexir.relu(hexir.linear(x, W1, b1)), W2, b2)
    return hexir.argmax(logits), hexir.softmax(logits)


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    classes, probabilities = classify(x_test)
    predicted = net.classes_[classes]
    assert (predicted == net.predict(x_test)).all(), "hexir's predictions differ from scikit-learn's"
    np.testing.assert_allclose(probabilities, net.predict_proba(x_test), rtol=1e-12, atol=1e-15)
    accuracy = (predicted == y_test).mean()
    print(f"first ten predictions: {predicted[:10].tolist()} (true: {y_test[:10].tolist()})")
    print(f"matches scikit-learn: all {len(x_test)} predictions equal, probabilities within "
          f"{np.abs(probabilities - net.predict_proba(x_test)).max():.1e}; accuracy {accuracy:.3f}")
    # one module for every batch size
    path = hexir.export(classify, out / "classifier.hxb", hexir.TensorSpec(("batch", 64), "float64"))
    np.save(out / "classifier_x.npy", x_test[:5])
    here = os.path.relpath
    print(f"wrote {here(path)}; run it with: hexir-run {here(path)} --input x={here(out / 'classifier_x.npy')}")
