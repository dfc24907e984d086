package messaging_test

import (
	"encoding/json"
	"os"
	"reflect"
	"regexp"
	"sort"
	"testing"

	messaging "settle.dev/messaging"
)

func keys(prefix string, v any, out *[]string) {
	if m, ok := v.(map[string]any); ok {
		for k, x := range m {
			*out = append(*out, prefix+k)
			keys(prefix+k+".", x, out)
		}
	}
}

// The report this runtime writes has exactly the fields of the documented example
// (docs/stats-report.md), so the document is what a runtime in a third language writes too.
func TestTheReportHasTheDocumentedFields(t *testing.T) {
	doc, err := os.ReadFile("../../docs/stats-report.md")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile("(?s)## The document\\s+```json\\n(.*?)```").FindSubmatch(doc)
	if m == nil {
		t.Fatal("docs/stats-report.md has no JSON example under \"The document\"")
	}
	var example map[string]any
	if err := json.Unmarshal(m[1], &example); err != nil {
		t.Fatal(err)
	}
	ours, _ := json.Marshal(messaging.StatsReport{SubscriptionUID: "u", DurableName: "d"})
	var mine map[string]any
	_ = json.Unmarshal(ours, &mine)
	var want, got []string
	keys("", example, &want)
	keys("", mine, &got)
	sort.Strings(want)
	sort.Strings(got)
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("fields\n got %v\nwant %v", got, want)
	}
}

// The key: <namespace>.<subscription>.<instance>, each part reduced to the KV key alphabet.
func TestTheReportKeyIsReducedToTheKeyAlphabet(t *testing.T) {
	for _, c := range [][4]string{
		{"shop", "orders", "orders-7f9c6d-x2k4q-1796011200000", "shop.orders.orders-7f9c6d-x2k4q-1796011200000"},
		{"team.a", "in voices", "host/1", "team_a.in_voices.host_1"},
		{"", "é", "a*b>c", "_._.a_b_c"},
	} {
		if got := messaging.ReportKey(c[0], c[1], c[2]); got != c[3] {
			t.Errorf("ReportKey(%q, %q, %q) = %q, want %q", c[0], c[1], c[2], got, c[3])
		}
	}
}
