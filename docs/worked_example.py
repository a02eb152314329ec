"""The worked example of docs/privacy.md: run `python docs/worked_example.py`."""

import numpy as np

from flwr_inca import PermanentDropout, run_inca
from flwr_inca.privacy import adversarial_collusion, analyze_structure, calibrate, certify, random_collusion

n, d, C = 200, 50, 1.0  # 200 parties, 50-dim updates clipped to L2 norm C
rng = np.random.default_rng(0)
x = rng.standard_normal((n, d))
x *= (C * rng.random(n) / np.linalg.norm(x, axis=1))[:, None]

# 1. calibrate for (1, 1e-5)-DP against 10% colluders, with 10% permanent dropouts
cal = calibrate(1.0, 1e-5, n, iterations=20, neighbors=1, collusion=0.1, dropout=PermanentDropout(0.1),
                runs=50, seed=0, value_sensitivity=2 * C, value_variance=float(x.var(axis=0).mean()))
print(f"calibrated: sigma_star = {cal.sigma_star:.4f}, sigma_delta = {cal.sigma_delta:.4f}, "
      f"alpha = {cal.alpha}, runs certified = {cal.success_fraction:.0%}, predicted MSE = {cal.predicted_mse:.5f}")

# 2. run, then certify the execution that actually happened
result = run_inca(x, cal.config(dropout=PermanentDropout(0.1)), seed=7)
print(f"{result.finalists.size} of {n} parties finished; "
      f"MSE = {np.mean((result.estimate - x.mean(axis=0)) ** 2):.5f}")
view = random_collusion(result.trace, 0.1, seed=1)
cert = certify(result.trace, view, value_sensitivity=2 * C, delta=1e-5)
print(f"certificate: weakest honest party mu = {cert.max_mu:.4f} -> epsilon = {cert.epsilon:.4f} at delta = 1e-5")
report = analyze_structure(result.trace, view)
print(report.summary())
for i in cert.weakest[:3]:
    print(f"  party {i}: mu = {cert.mu[i]:.4f}, epsilon = {cert.party_epsilon(i):.4f} ({report.exposure[i].explain(20)})")

# 3. references: the same (epsilon, delta) with a trusted curator, and locally
sigma_central = 2 * C / (n * cal.mu_target)
print(f"central DP MSE = {sigma_central ** 2:.5f}, local DP MSE = {n * sigma_central ** 2:.5f}")

# 4. stress test: an adversary that picks the colluders after seeing the topology
adv = adversarial_collusion(result.trace, 0.1, value_sensitivity=2 * C, delta=1e-5)
print(f"adversarially chosen colluders: party {adv.target} gets epsilon = {adv.certificate.epsilon:.4f}")
