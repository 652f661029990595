"""The demo's compression part runs on real digits and reports every method's true ratio."""
import gradcomp
from gradcomp import demo


def test_compress_table_reports_every_method_with_its_wire_bytes():
    model = demo.DigitsNet()
    raw = 4 * sum(p.numel() for p in model.parameters())
    lines = demo.compress_table().splitlines()[2:]
    rows = {line.split()[0]: line.split() for line in lines}
    assert set(rows) == set(gradcomp.METHODS)
    expected_fp16 = sum(gradcomp.get_method("fp16").wire_bytes(p.numel()) for p in model.parameters())
    assert int(rows["fp16"][1]) == expected_fp16  # 2 bytes an element, each payload padded to 16
    assert raw // 2 <= expected_fp16 < raw // 2 + 16 * len(list(model.parameters()))
    for method, row in rows.items():
        assert int(row[1]) < raw, method
        assert 0 <= float(row[3]) < 1, method  # relative error of the decoded gradients
