package nats

import "testing"

func TestAnAckSubjectNamesItsStreamConsumerAndDeliveryCountInEitherForm(t *testing.T) {
	for _, c := range []struct {
		reply, stream, consumer string
		delivered               int
		ok                      bool
	}{
		{"$JS.ACK.ORDERS.orders.1.22.22.1700000000000000000.0", "ORDERS", "orders", 1, true},
		{"$JS.ACK.hub.ACCHASH.ORDERS.orders.3.22.22.1700000000000000000.0.r", "ORDERS", "orders", 3, true},
		{"$JS.ACK.hub.ACCHASH.ORDERS.orders.7.22.22.1700000000000000000.0", "ORDERS", "orders", 7, true},
		{"_INBOX.abc", "", "", 0, false},
		{"$JS.ACK.ORDERS.orders.1", "", "", 0, false},
	} {
		s, cons, d, ok := ackSubject(c.reply)
		if s != c.stream || cons != c.consumer || d != c.delivered || ok != c.ok {
			t.Errorf("%s: %q %q %d %v", c.reply, s, cons, d, ok)
		}
	}
}
